from llmctl.cli import main

main()
