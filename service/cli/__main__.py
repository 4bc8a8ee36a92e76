"""``python -m service.cli``: the ``loadmaster`` command without the installed script."""

from service.cli.main import main

raise SystemExit(main())
