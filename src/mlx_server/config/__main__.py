"""``python -m mlx_server.config``: print the flag table, or write it into a document."""

from mlx_server.config.flag_table import main

raise SystemExit(main())
