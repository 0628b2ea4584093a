/* SPDX-License-Identifier: Apache-2.0 */
/* What a refused connect() tells its user: whose socket it is, and how to become one of them. */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

/* The most memory getgrgid_r() may take for one answer (a group of many members). */
#define GETGR_BUF_MAX (1u << 20)

/* Is @p gid this process's group now (effective or supplementary)? */
static bool in_group_now(gid_t gid)
{
	gid_t *groups;
	bool in = getegid() == gid;
	int n = getgroups(0, NULL);

	if (in || n <= 0)
		return in;
	groups = malloc((size_t)n * sizeof(*groups));
	if (!groups)
		return false;
	n = getgroups(n, groups);
	for (int i = 0; i < n && !in; i++)
		in = groups[i] == gid;
	free(groups);
	return in;
}

/* Is the user of this process a member of @p gr in the group database (or is it their primary
 * group)? */
static bool member_in_db(const struct group *gr)
{
	struct passwd pw, *pwp = NULL;
	char buf[4096];
	bool in = false;

	if (getpwuid_r(geteuid(), &pw, buf, sizeof(buf), &pwp) || !pwp)
		return false;
	in = pw.pw_gid == gr->gr_gid;
	for (char **m = gr->gr_mem; m && *m && !in; m++)
		in = !strcmp(*m, pw.pw_name);
	return in;
}

/* Look up @p gid: the entry in @p gr, its strings in *@p buf (the caller frees it); false if the
 * database has none (or no memory). */
static bool group_of(gid_t gid, struct group *gr, char **buf)
{
	struct group *found = NULL;
	size_t len = 4096;
	int r;

	*buf = NULL;
	for (;;) {
		char *b = realloc(*buf, len);

		if (!b)
			return false;
		*buf = b;
		r = getgrgid_r(gid, gr, b, len, &found);
		if (r != ERANGE || len >= GETGR_BUF_MAX)
			break;
		len *= 2;
	}
	return !r && found;
}

void dlpc__access_hint(const char *path, char *buf, size_t len)
{
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)], *slash, *grbuf;
	const char *what = "socket";
	struct group gr;
	struct stat st;

	buf[0] = '\0';
	if (stat(path, &st) < 0) {
		/* the directory may be what keeps us out: whose is it? */
		snprintf(dir, sizeof(dir), "%s", path);
		slash = strrchr(dir, '/');
		if (!slash || slash == dir || stat((*slash = '\0', dir), &st) < 0)
			return;
		what = "directory";
	}
	if (st.st_gid == 0) {
		snprintf(buf, len,
			 "; the %s belongs to group root (mode %04o): the daemon's --socket-group "
			 "names the group whose members may connect",
			 what, (unsigned)(st.st_mode & 07777));
		return;
	}
	if (!group_of(st.st_gid, &gr, &grbuf)) {
		snprintf(
			buf, len,
			"; the %s belongs to group %u (mode %04o), which has no name here: ask its "
			"administrator to add you to it",
			what, (unsigned)st.st_gid, (unsigned)(st.st_mode & 07777));
		free(grbuf);
		return;
	}
	if (in_group_now(st.st_gid))
		snprintf(buf, len,
			 "; the %s belongs to group '%s', which this process is in, but its mode "
			 "%04o lets the group no access",
			 what, gr.gr_name, (unsigned)(st.st_mode & 07777));
	else if (member_in_db(&gr))
		snprintf(buf, len,
			 "; the %s belongs to group '%s': you were added to it after this session "
			 "began; log in again (or run 'newgrp %s')",
			 what, gr.gr_name, gr.gr_name);
	else
		snprintf(
			buf, len,
			"; the %s belongs to group '%s': join it with 'sudo usermod -aG %s $USER', "
			"then log in again",
			what, gr.gr_name, gr.gr_name);
	free(grbuf);
}
