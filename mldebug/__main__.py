"""`python -m mldebug script.py` — see `mldebug.cli`.

The program runs in a fresh `__main__` module; this file only hands over to the CLI
living in a normal module, so nothing here is needed once the program starts.
"""
from mldebug.cli import main

if __name__ == "__main__":
    main()
