from mlx_server.cli import main

raise SystemExit(main())
