import sys

from andromeda_cli.main import main

sys.exit(main())
