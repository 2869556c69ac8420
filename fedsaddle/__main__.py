import sys

from fedsaddle.entry import main

sys.exit(main())
