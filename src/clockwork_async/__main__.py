import sys

from clockwork_async.cli import main

sys.exit(main())
