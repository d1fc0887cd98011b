"""What lands on disk and stays: cache policy, output locks, the manifest and publish layout, disk space."""
