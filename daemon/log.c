/* SPDX-License-Identifier: Apache-2.0 */
/*
 * One line per decision on stderr. When journald reads stderr (JOURNAL_STREAM names our stderr),
 * lines carry "<N>" priority prefixes and no timestamp; otherwise a timestamp and a level word.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base.h"

int dlpd_log_level = LOG_INFO;
static bool journal;

static const char *const level_names[] = {
	[LOG_EMERG] = "emerg", [LOG_ALERT] = "alert",	  [LOG_CRIT] = "crit",
	[LOG_ERR] = "err",     [LOG_WARNING] = "warning", [LOG_NOTICE] = "notice",
	[LOG_INFO] = "info",   [LOG_DEBUG] = "debug",
};

void dlpd_log_init(void)
{
	const char *js = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;

	journal = js && sscanf(js, "%llu:%llu", &dev, &ino) == 2 &&
		  fstat(STDERR_FILENO, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

int dlpd_log_parse_level(const char *s)
{
	char *end;
	long v = strtol(s, &end, 10);

	if (*s && !*end)
		return v >= LOG_ERR && v <= LOG_DEBUG ? (int)v : -1;
	for (int i = LOG_ERR; i <= LOG_DEBUG; i++)
		if (strcasecmp(s, level_names[i]) == 0)
			return i;
	if (strcasecmp(s, "error") == 0)
		return LOG_ERR;
	if (strcasecmp(s, "warn") == 0)
		return LOG_WARNING;
	return -1;
}

void dlpd_log(int prio, const char *fmt, ...)
{
	char line[1024];
	size_t n = 0;
	va_list ap;

	if (prio > dlpd_log_level)
		return;
	if (journal) {
		n = (size_t)snprintf(line, sizeof(line), "<%d>", prio);
	} else {
		struct timespec ts;
		struct tm tm;

		clock_gettime(CLOCK_REALTIME, &ts);
		localtime_r(&ts.tv_sec, &tm);
		n = strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
		n += (size_t)snprintf(line + n, sizeof(line) - n,
				      ".%03ld dlpackd[%d]: %s: ", ts.tv_nsec / 1000000,
				      (int)getpid(), level_names[prio]);
	}
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof(line) - n, fmt, ap);
	va_end(ap);
	n = strlen(line);
	if (n == sizeof(line) - 1)
		n--;
	line[n++] = '\n';
	/* one write per line so lines from a dying daemon never interleave */
	if (write(STDERR_FILENO, line, n) < 0)
		return;
}
