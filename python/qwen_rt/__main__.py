"""`python -m qwen_rt ...`: the same command line as `qwen-rt ...`."""
import sys

from qwen_rt.cli import main

sys.exit(main())
