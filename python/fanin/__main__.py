from fanin.cli import main

raise SystemExit(main())
