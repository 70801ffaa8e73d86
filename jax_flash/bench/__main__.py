import sys

from jax_flash.bench.cli import main

sys.exit(main())
