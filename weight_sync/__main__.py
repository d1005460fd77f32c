import sys

from weight_sync.cli import main

sys.exit(main())
