import sys

from pagedmoe.train.cli import main

sys.exit(main())
