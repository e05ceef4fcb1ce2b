from pagedmoe.entrypoints.cli import main

main()
