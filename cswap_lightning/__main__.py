from .commands.cli import main

raise SystemExit(main())
