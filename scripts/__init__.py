"""Command-line tools and test harnesses kept apart from the library."""
