"""The built-in tasks, each a module that generates its data and scores completions (the protocol: tasks/common.py)."""
