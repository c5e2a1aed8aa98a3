"""Lightning callbacks, one concern per file (compression, consistency checks, guards, statistics)."""
