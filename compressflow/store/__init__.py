"""What lands on disk and stays: cache policy, output locks, the manifest (`manifest`), where an
output goes (`output`), staging and sealing (`staging`), disk space."""
