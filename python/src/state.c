/* SPDX-License-Identifier: Apache-2.0 */
/* dlpack_ipc._core: the module state, found from one of the module's types. */
#include "dlpack_ipc.h"

const struct PyModuleDef *ipc_state_def;

ipc_state *ipc_state_of_type(PyTypeObject *tp)
{
	/*
	 * By definition, so that Python subclasses (dlpack_ipc.Client) find it too: the first
	 * class in the MRO that this module made. (PyType_GetModuleByDef() does the same, but
	 * enters the limited API only in 3.13.)
	 */
	PyObject *mro = PyObject_GetAttrString((PyObject *)tp, "__mro__");
	ipc_state *st = NULL;
	Py_ssize_t n = mro ? PyTuple_Size(mro) : -1;

	for (Py_ssize_t i = 0; !st && i < n; i++) {
		PyTypeObject *base = (PyTypeObject *)PyTuple_GetItem(mro, i);
		PyObject *m;

		if (!(PyType_GetFlags(base) & Py_TPFLAGS_HEAPTYPE))
			continue;
		m = PyType_GetModule(base);
		if (!m)
			PyErr_Clear(); /* a class made by Python code */
		else if (PyModule_GetDef(m) == ipc_state_def)
			st = PyModule_GetState(m);
	}
	Py_XDECREF(mro);
	if (!st && !PyErr_Occurred())
		PyErr_Format(PyExc_TypeError, "%R is not a dlpack_ipc type", (PyObject *)tp);
	return st;
}
