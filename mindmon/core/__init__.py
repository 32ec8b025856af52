"""The engine: the interfaces (engine), records, the step's events, the group that routes them, the
assembly every front door calls (factory), and this process's progress."""
