import sys

from jaxprep.cli import main

sys.exit(main())
