import sys

from weight_sync.tools.cli import main

sys.exit(main())
