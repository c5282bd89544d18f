import sys

from collabopt.cli import main

sys.exit(main())
