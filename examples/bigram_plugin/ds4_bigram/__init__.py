"""An example third-party model plugin for ds4: the smallest complete model family."""
