import sys

from swiftlm.cli.main import main

sys.exit(main())
