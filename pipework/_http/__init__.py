"""What the container, the board and the proxy speak over HTTP, below all of them.

Problem documents (``_problems``), request and response bodies (``_bodies``), the
credentials a request brings (``_credentials``), a job's document and owner token
(``_jobs``) and the paths the container keeps for itself (``_paths``). The container serves
routes and the job API with them; the board serves boards and job streams; the proxy
passes requests on. None imports another's modules for these: the board and the proxy sit
below the container, and this package below them all (docs/design.md, "Layers").
"""
