"""Command-line tools: `kvstore` (serve, demo) and `kvctl` (stats). Entry files only wire groups."""
