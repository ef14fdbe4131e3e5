"""What every layer may use: torch where installed, threads, devices, collectives, the output lock, the Arrow memory pool, the moved-module names."""
