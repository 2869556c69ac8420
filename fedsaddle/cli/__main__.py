import sys

from fedsaddle.cli import main

sys.exit(main())
