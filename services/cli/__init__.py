"""The `radixserve` command: serve (three supervised processes), one service, generate, bench."""
