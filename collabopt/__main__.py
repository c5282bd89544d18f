"""``python -m collabopt``: the collabopt command (:mod:`collabopt.cli`)."""

import sys

try:
    from collabopt.cli import main
except KeyboardInterrupt:  # Ctrl+C while importing (torch, hivemind: a second or two): 130, as in every command
    sys.exit(130)

sys.exit(main())
