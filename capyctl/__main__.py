from capyctl.cli import main

raise SystemExit(main())
