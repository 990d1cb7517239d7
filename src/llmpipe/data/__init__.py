"""Datasets the `prepare` stage builds: the embedded stdlib corpus (`stdlib`), users' files and hub datasets
(`sources`), the seeded hash split shared by both (`splits`), and the common result with its eval sets (`corpus`).
"""
