from lightning_efficient.commands import main

raise SystemExit(main())
