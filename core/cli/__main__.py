"""``python -m loopstack.cli``."""

from loopstack.cli.main import main

raise SystemExit(main())
