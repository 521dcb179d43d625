import sys

from sglang_harden.cli import main

sys.exit(main())
