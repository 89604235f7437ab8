"""What the tests share: the rank harness, the in-memory and thread planes, references,
the attackers, the Swarm jobs (not tests themselves)."""
