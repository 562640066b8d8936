package scheduling

import "fmt"

// Claim is SelectN with the first endpoint's slot taken (Endpoint.Claim).
// A pick finds an endpoint healthy before the slot is taken: should it have
// turned half-open in between, and another request have become its one
// probe, it is picked again as a pick now would, which passes it over for
// a healthy endpoint, or, in the decode pool with none left, routes among
// the ejected ones as candidates does.
func (p *Pool) Claim(req *Request, n int, exclude ...string) ([]*Endpoint, *Slot, error) {
	eps, err := p.SelectN(req, n, exclude...)
	if err != nil {
		return nil, nil, err
	}
	if s := eps[0].claim(true); s != nil {
		return eps, s, nil
	}
	if eps, err = p.SelectN(req, n, exclude...); err != nil {
		return nil, nil, err
	}
	return eps, eps[0].Claim(), nil
}

// Attempts hands out the endpoints of one request's retry budget: each Next
// picks an endpoint not tried yet, until the budget or the pool runs out.
// It is for one request, used by one goroutine.
type Attempts struct {
	pool  *Pool
	req   *Request
	left  int
	tried []string
}

// Attempts starts a retry budget of n tries (at least one) for req.
func (p *Pool) Attempts(req *Request, n int) *Attempts {
	return &Attempts{pool: p, req: req, left: max(n, 1)}
}

// Next returns the endpoint for the next try with its slot taken (Claim).
// The error is ErrTried once the budget is spent, or why the pool has no
// untried endpoint left.
func (a *Attempts) Next() (*Endpoint, *Slot, error) {
	if a.left == 0 {
		return nil, nil, fmt.Errorf("%s: %w", a.pool.Name(), ErrTried)
	}
	eps, s, err := a.pool.Claim(a.req, 1, a.tried...)
	if err != nil {
		return nil, nil, err
	}
	a.left--
	a.tried = append(a.tried, eps[0].Addr)
	return eps[0], s, nil
}
