"""The pieces of mldebug's prompt: its ML commands and its IPython terminal. The
debugger that puts them together is mldebug/debugger.py."""
