from lightning_efficient.cli import main

raise SystemExit(main())
