"""verl.tools (the base tool and its schemas)."""
