from grooves.cli import main

main()
