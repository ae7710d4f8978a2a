"""What is trained: built-in data sets, models and emulated compute (:mod:`.catalog` holds their facts
without importing torch)."""
