"""`python -m zeroshard ...`: the same as the `zeroshard` command."""
from zeroshard.app.cli import main

main()
