"""One ``CollaborativeTrainer`` peer, run as its own OS process by the Trainer swarm tests.

Usage: ``python tests/swarm/transformers_worker.py config.json``. Trains a tiny GPT-2 (built from a config, random
weights) on made-up token sequences that follow a rule (next token = previous + step, mod the vocabulary), so the
loss can fall. Writes ``<out>.json`` (what the test checks), ``<out>.epochs.pt`` (the parameters right after each
global epoch) and ``<out>.progress`` (its epoch, for the other peers' finish line). Under ``torchrun`` rank R > 0
writes ``<out>.rankR.json`` / ``.epochs.pt`` / ``.pt``.

Config keys: run_id, target_batch_size, max_steps (global epochs), bs (per_device_train_batch_size), ga
(gradient_accumulation_steps), n (samples), data_seed, lr, warmup, schedule (lr_scheduler_type), save_steps,
output_dir, resume (a checkpoint folder), wait_peers, outer (DiLoCo: SGD arguments of outer_optimizer), finish_with.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from collabopt.integrations.transformers import CollaborativeTrainer  # noqa: E402
from peer_worker import at_finish_line, progress_of, rank0_decides, write_json  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

VOCAB, LENGTH = 32, 12


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every peer starts from the same weights
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def make_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    steps = torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + steps * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Recorder(TrainerCallback):
    """Records what the test checks: at joining, after each global epoch, and the finish line."""

    def __init__(self, trainer: CollaborativeTrainer, cfg: dict, result: dict):
        self.trainer, self.cfg, self.result = trainer, cfg, result
        self.epoch_params: dict[int, dict] = {}
        self.epoch = None

    def on_train_begin(self, args, state, control, **kwargs):
        copt = self.trainer.collaborative_optimizer  # joined by CollaborativeTrainer's callback, which runs first
        opt_state = copt.optimizer.state
        self.result["start"] = {
            "epoch": copt.local_epoch, "global_step": state.global_step,
            "lr": self.trainer.optimizer.param_groups[0]["lr"],
            "exp_avg_sum": float(sum(float(s["exp_avg"].double().sum()) for s in opt_state.values() if "exp_avg" in s)),
            "param_sum": float(sum(float(p.double().sum()) for p in self.trainer.model.parameters())),
            "diloco": copt.config.outer_optimizer is not None,
        }
        self.epoch = copt.local_epoch
        if self.cfg.get("wait_peers"):  # start together (a peer alone would race through the epochs)
            assert copt.wait_for_peers(self.cfg["wait_peers"], timeout=60), "the other peer did not show up"

    def on_step_end(self, args, state, control, **kwargs):
        copt = self.trainer.collaborative_optimizer
        if copt.local_epoch != self.epoch:
            self.epoch = epoch = copt.local_epoch
            self.result["lrs"][str(epoch)] = self.trainer.optimizer.param_groups[0]["lr"]
            self.result["sched_lrs"][str(epoch)] = self.trainer.lr_scheduler.get_last_lr()[0]
            self.result["local_steps_at"][str(epoch)] = state.global_step
            self.epoch_params[epoch] = snapshot(self.trainer.model)
        progress = progress_of(copt)
        if self.trainer.is_world_process_zero():
            write_json(self.cfg["out"] + ".progress", progress)
        # peers that reached the last epoch keep training until every peer did (see peer_worker.at_finish_line);
        # the ranks of a node stop at the same step (every rank sees the same local_epoch, so all get here alike)
        if control.should_training_stop and not rank0_decides(
                at_finish_line(self.cfg, copt.local_epoch, self.trainer.target_epochs, progress["in_sync"])):
            control.should_training_stop = False


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    model = make_model()
    args = TrainingArguments(
        output_dir=cfg["output_dir"], per_device_train_batch_size=cfg["bs"],
        gradient_accumulation_steps=cfg.get("ga", 1), max_steps=cfg["max_steps"], learning_rate=cfg.get("lr", 3e-3),
        warmup_steps=cfg.get("warmup", 0), lr_scheduler_type=cfg.get("schedule", "linear"), weight_decay=0.01,
        logging_steps=2, save_steps=cfg.get("save_steps", 10**6), save_strategy="steps", report_to=[],
        use_cpu=True, seed=cfg.get("data_seed", 0), dataloader_num_workers=0, disable_tqdm=True,
        per_device_eval_batch_size=32,
    )
    outer = {"outer_optimizer": functools.partial(torch.optim.SGD, **cfg["outer"])} if cfg.get("outer") else {}
    trainer = CollaborativeTrainer(
        model=model, args=args, train_dataset=make_data(cfg.get("n", 100), cfg.get("data_seed", 0)),
        eval_dataset=make_data(64, 999),
        run_id=cfg["run_id"], target_batch_size=cfg["target_batch_size"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=2.0, averaging_timeout=15.0, verbose=True, **outer,
    )
    rank = int(os.environ.get("RANK", "0"))
    out = cfg["out"] if rank == 0 else f"{cfg['out']}.rank{rank}"
    result: dict = {"lrs": {}, "sched_lrs": {}, "local_steps_at": {}, "rank": rank}
    recorder = Recorder(trainer, cfg, result)
    trainer.add_callback(recorder)  # after CollaborativeTrainer's own callback

    result["eval_loss_before"] = trainer.evaluate()["eval_loss"]
    fed = [0]  # samples of this process's training forward calls, counted here on their own

    def count(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            fed[0] += kwargs["input_ids"].shape[0]

    model.register_forward_pre_hook(count, with_kwargs=True)
    output = trainer.train(resume_from_checkpoint=cfg.get("resume"))
    copt = trainer.collaborative_optimizer
    result.update(
        final_epoch=copt.local_epoch, samples_fed=fed[0], target_epochs=trainer.target_epochs,
        samples_reported=copt.samples_reported, closed=copt.closed, global_step=output.global_step,
        eval_loss_after=trainer.evaluate()["eval_loss"], predict=trainer.predict(make_data(64, 999)).metrics,
        logs=[entry for entry in trainer.state.log_history if "loss" in entry],
        optimizer_restored=type(trainer.optimizer).__name__, type=type(copt).__name__,
    )
    torch.save(recorder.epoch_params, out + ".epochs.pt")
    torch.save(snapshot(trainer.model), out + ".pt")
    write_json(out + ".json", result)
    # torchrun: leave the process group together (Trainer.end() in transformers 5). Left to interpreter exit, a rank
    # of this job once aborted ("terminate called without an active exception") after writing its results.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
