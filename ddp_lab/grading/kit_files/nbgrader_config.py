"""nbgrader configuration of the student kit: the Validate button and `make validate`.

Students work in ``labs/`` and hand in with ``make submit``; the kit has no exchange and no
Assignment List (its Fetch would make a second copy of a lab outside ``labs/``). A course that
runs a shared nbgrader exchange (JupyterHub) sets up its own.
"""

c = get_config()  # noqa: F821 - provided by nbgrader

c.CourseDirectory.course_id = "ddp-lab"
c.Execute.timeout = 300
