"""umrt's native steady state, in one package (see ARCHITECTURE.md, "Learning in Python, acting natively")."""
