"""A dataset resolved once per job: the job's source, its growth."""
