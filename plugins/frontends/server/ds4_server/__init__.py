"""ds4 serve: the HTTP frontend."""
