"""What the container and the board both speak over HTTP, below both of them.

Problem documents (``_problems``), request and response bodies (``_bodies``), the
credentials a request brings (``_credentials``) and a job's document and owner token
(``_jobs``). The container serves routes and the job API with them; the board serves
boards and job streams. Neither imports the other's modules for these: the board sits below
the container, and this package below both (docs/design.md, "Layers").
"""
