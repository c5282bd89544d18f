"""hivemind, imported without the warnings its import raises that collabopt's users cannot act on.

collabopt's package imports this module first, so hivemind's first import (whichever collabopt module asks for it)
happens here. hivemind decorates functions with ``torch.jit.script`` at import, which torch deprecates: a
DeprecationWarning up to torch 2.13 (hidden by default), a FutureWarning from 2.14 on, printed before every line
of every program that imports collabopt. The filters match exactly that warning (category, message, the torch
module that raises it) and hold only while hivemind is imported: the warnings filters are the user's again
afterwards, and the user's own ``torch.jit.script`` still warns.
"""

from __future__ import annotations

import warnings

# (category, message regex, module regex): warnings of hivemind's import that only hivemind can fix
HIVEMIND_IMPORT_WARNINGS = tuple(
    (category, r"`torch\.jit\.script` is (deprecated|not supported)", r"torch\.jit\._script")
    for category in (FutureWarning, DeprecationWarning)
)

with warnings.catch_warnings():
    for category, message, module in HIVEMIND_IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    import hivemind  # noqa: F401
