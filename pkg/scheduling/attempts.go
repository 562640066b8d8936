package scheduling

import "fmt"

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

// Next returns the endpoint for the next try. The error is ErrTried once the
// budget is spent, or why the pool has no untried endpoint left.
func (a *Attempts) Next() (*Endpoint, error) {
	if a.left == 0 {
		return nil, fmt.Errorf("%s: %w", a.pool.Name, ErrTried)
	}
	e, err := a.pool.Select(a.req, a.tried...)
	if err != nil {
		return nil, err
	}
	a.left--
	a.tried = append(a.tried, e.Addr)
	return e, nil
}
