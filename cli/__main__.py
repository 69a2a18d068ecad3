"""`python -m sage_tfx.cli`: the `sage-tfx` console script."""
import sys

from sage_tfx.cli import main

sys.exit(main())
