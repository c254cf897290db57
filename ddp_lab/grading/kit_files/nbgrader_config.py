"""nbgrader configuration of the student kit: the Validate button and the Assignment List.

The labs are released into a local exchange (``.exchange/``) inside the kit, so that the
Assignment List shows them on a laptop too; a course that runs a shared exchange
(JupyterHub) replaces ``Exchange.root`` with its own.
"""

import os

c = get_config()  # noqa: F821 - provided by nbgrader

ROOT = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "ddp-lab"
c.CourseDirectory.root = ROOT
c.Exchange.root = os.path.join(ROOT, ".exchange")
c.Exchange.path_includes_course = True
c.Execute.timeout = 300
