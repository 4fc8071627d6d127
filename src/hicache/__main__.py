"""`python -m hicache`: the same as the `hicache` command."""

from hicache.cli import main

raise SystemExit(main())
